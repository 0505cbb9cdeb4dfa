"""Generic parallelisms: each a plain function that takes a model and a mesh and changes it in place."""
