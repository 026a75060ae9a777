"""Configuration: ``fit`` (``api``), loop settings (``args``, ``flags``), advice on scales, class-path specs
(``spec``), the catalog and the ``fedlight`` command (``cli``)."""
