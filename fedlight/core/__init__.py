"""The rule contract: what a client and a server do (``rules``), tensor-dict helpers (``params``), the registry of
algorithms and the one forward pass under a precision plugin. Imports nothing of the engine or the configuration."""
