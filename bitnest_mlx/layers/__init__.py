"""nn.Modules that know a storage format, not a model."""
