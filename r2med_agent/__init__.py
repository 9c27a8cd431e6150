"""r2med-agent: reasoning-augmented medical retrieval on the R2MED benchmark."""

__version__ = "0.1.0"
