"""`recsys preprocess`'s configs, read and copied by users here; installed as
the package recsys_cli._preprocess_configs (pyproject.toml), where the command
finds them."""
