"""The line each solution region of a workbook becomes (distlab.exercises) and the message it
raises (distlab.checks names an unsolved stub by it). A leaf module: every rank of every check
imports distlab.checks, and distlab.exercises imports nbformat and jsonschema (≈3 CPU-s)."""
MESSAGE = "exercise: replace this line with your code"
STUB = f'raise NotImplementedError("{MESSAGE}")'
