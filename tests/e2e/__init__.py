"""The documented ways in, run as a user runs them: install, the CLI, the notebook, the real model."""
