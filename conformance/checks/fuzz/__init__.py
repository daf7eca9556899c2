"""The fuzz area: hypothesis-generated models checked against the rules of every part."""
