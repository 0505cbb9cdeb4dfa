import os

# Unit tests exercise the CPU paths, also on a machine with a GPU (tests/gpu covers CUDA).
os.environ["CUDA_VISIBLE_DEVICES"] = ""
