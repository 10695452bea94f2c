"""multihost's implementation, in packages (the public names are in multihost/__init__.py).

Each package is one part, and imports run one way: a package imports only
the packages listed after it in LAYERS (tests/unit/test_layers.py checks it
against the imports themselves).
"""

# Top to bottom.
LAYERS = ('api', 'control', 'transport', 'diagnostics', 'auth', 'liveness',
          'clusters', 'runtime')
