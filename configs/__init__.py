"""ml_collections configs: each module exposes `get_config()`."""
