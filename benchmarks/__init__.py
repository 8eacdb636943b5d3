"""asyncckpt's benchmarks, run from a source checkout (not part of the installed package).

``python -m benchmarks`` runs the suite (``benchmarks/suite``; ``make bench``). The crash
campaign (``crash_campaign.py``) is run by the durability tests; ``archive/`` keeps the
scripts of past investigations. See README.md here.
"""
