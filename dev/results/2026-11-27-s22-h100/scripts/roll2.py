"""roll.py's Qwen2.5-0.5B rollout with GroupSampler.SYNC_EVERY set (1000: no host check of the stop flags while
decoding): what the every-16-steps sync costs."""
import os, sys
sys.path.insert(0, os.getcwd())
import importlib
mg = importlib.import_module("model.generate")
mg.GroupSampler.SYNC_EVERY = int(os.environ["SYNC_EVERY"])
sys.argv = [sys.argv[0], "--tokenizer", os.environ["TOK"], "--shapes", "qwen2.5-0.5b"]
exec(open(os.path.join(os.path.dirname(__file__), "roll.py")).read())
