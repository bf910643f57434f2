"""Request bodies -> dataclasses -> engine requests, one module per API; validation happens here."""
