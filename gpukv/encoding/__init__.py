"""Values in the forms they travel in: the gradient compressors, one module each
(`compressors/`), their use around a one-process store's reduction (`compression.py`), and
row-sparse values with their row merge (`sparse.py`)."""
