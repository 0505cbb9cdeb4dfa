"""`python -m titanrush <command> [args]`: the `titanrush` console script (titanrush.cli)."""

from titanrush.cli import run

if __name__ == "__main__":
    run()
