"""One module per route family, on handlers/base.py: admit -> parse -> render -> submit -> drain."""
