"""`python -m lab.prepare`: everything a chapter needs offline, made once (idempotent, fast when done)."""

from . import data
from .models.load import smollm2_folder

if __name__ == "__main__":
    print("default model:", smollm2_folder())
    print("Shakespeare:", len(data.plays()), "plays")
