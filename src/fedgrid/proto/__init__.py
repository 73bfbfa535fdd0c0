"""Wire protocol: the ``fedgrid.v1`` schema, its committed generated code, and ``serde``."""
