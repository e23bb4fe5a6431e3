"""Sample-quality metrics: FID, Inception Score, precision/recall (Inception features from a local weights file)
and CLIP score (a local CLIP). `python -m opendit.eval --help`; docs/evaluation.md."""
from opendit.eval.data import RefStats, UserError, open_images, open_ref_stats, save_stats
from opendit.eval.metrics import clip_scores, feature_stats, frechet_distance, inception_score, precision_recall

__all__ = ["RefStats", "UserError", "open_images", "open_ref_stats", "save_stats", "clip_scores", "feature_stats",
           "frechet_distance", "inception_score", "precision_recall"]
