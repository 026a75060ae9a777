"""The engine: one round (``loop``), the run from round to round (``driver``), the state a run carries
(``state``), per-client state (``client_store``), float64 aggregation and seeded sampling."""
