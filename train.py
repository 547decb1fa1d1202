"""Entry point. Today: the quickstart (DGC vs dense DDP on scikit-learn's digits, 2 CPU processes, offline)."""

from recipes.quickstart import run_quickstart

if __name__ == "__main__":
    run_quickstart()
