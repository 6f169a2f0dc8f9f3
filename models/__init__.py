"""Model classes, installed as bitnest_mlx.models."""
