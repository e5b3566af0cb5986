"""OpenAI-compatible HTTP serving: app.py's create_app(engine) and the AsyncEngine it runs on
(async_engine.py). Import from the modules: importing the package loads nothing else."""
