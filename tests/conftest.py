import os
import sys

# The suite runs on CPU; several tests need more than one host device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
