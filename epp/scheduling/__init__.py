"""Scheduling: filters → weighted scorers → picker, composed into profiles from config."""
