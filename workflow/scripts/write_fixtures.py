"""Regenerate the synthetic fixtures under data/fixtures/ (deterministic; committed files).

Usage: python workflow/scripts/write_fixtures.py [ROOT] [SEED]
"""

import sys

from kvdiverge.datasets.fixtures import write_fixtures

if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "data/fixtures"
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 20261129
    for path in write_fixtures(root, seed):
        print(path)
