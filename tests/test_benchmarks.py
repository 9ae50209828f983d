"""Smoke tests of the scripts in benchmarks/ (tiny sizes, current backend)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_attention_benchmark_runs():
    # One length keeps it to two fresh worker processes (each imports Keras).
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "attention.py")]
    command += ["--lengths", "64", "--repeats", "1", "--heads", "2", "--key-dim", "8", "--features", "16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| length |")))
    assert lines[header + 1].startswith("|---:")
    row = lines[header + 2].split("|")
    assert row[1].strip() == "64"
    # Both methods ran: times and memories are numbers, not statuses.
    for cell in (row[2], row[3], row[5], row[6]):
        float(cell)
    assert any(line.startswith("Crossover:") for line in lines)


def test_evaluation_speed_benchmark_runs():
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "evaluation_speed.py")]
    command += ["--names", "mnist-baseline-small", "--batch-size", "2", "--num-samples", "2", "--repeats", "1", "--tiny"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| mnist-baseline-small"))
    cells = row.split("|")
    assert float(cells[2]) > 0 and float(cells[3]) > 0
