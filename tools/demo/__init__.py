"""Training (``python -m tools.demo.train``) and evaluation (``python -m tools.demo.evaluate``) of the demo
model set that ships under ``workers/models/demo/weights``; ``workers.models.demo`` loads it at run time without this code.
"""
