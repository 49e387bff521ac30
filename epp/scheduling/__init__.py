"""Scheduling: filters → weighted scorers → picker, composed into profiles from config
(config.py, framework.py); each plugin a module of plugins/, registered and declaring what it
consumes (registry.py)."""
