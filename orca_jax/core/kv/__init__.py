"""The KV pool seen from the host: which pages each request holds (manager.py), and full pages
indexed by their content for prefix caching (prefix_index.py)."""
