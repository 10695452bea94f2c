"""recovery's implementation, in packages (the public names are in recovery/__init__.py).

Imports run one way: a package imports only the packages listed after it in
LAYERS (tests/unit/test_layers.py checks it).
"""

# Top to bottom.
LAYERS = ('run', 'checkpoint', 'local', 'state')
