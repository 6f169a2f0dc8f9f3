"""Metal kernel sources (`*.metal`), shipped as package data of bitnest_mlx."""
