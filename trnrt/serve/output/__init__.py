"""The shared output assembler (assembler.py), the GLM parsers, and each API's renderer."""
