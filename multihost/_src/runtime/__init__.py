"""The process's state: the Runtime and its settings, the coordination client, errors and their wording, call numbering, the flight recorder, the companion service."""
