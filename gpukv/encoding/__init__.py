"""Values in the forms they travel in: compressed gradients (`compression.py`) and
row-sparse values with their row merge (`sparse.py`)."""
