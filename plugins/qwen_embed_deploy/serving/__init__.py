"""Serving helpers shared by the Triton model.py files and the local server launcher."""
