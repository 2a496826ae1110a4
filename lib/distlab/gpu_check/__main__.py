import sys

# The importable package's main, so the ranks find the strategies' functions by name.
from distlab.gpu_check import main

sys.exit(main())
