"""privlearn: differentially private machine learning with certified accounting."""

__version__ = "0.1.0"
