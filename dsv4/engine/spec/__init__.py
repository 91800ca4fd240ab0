"""Speculative decoding with the MTP drafter: drafts proposed (`drafting.py`), verified against
the target by greedy match or rejection sampling (`verify.py`), and under `auto` the K of each
step chosen from measured step costs (`policy.py`, timed at start by `calibration.py`).
Details: docs/serving.md section 3."""
