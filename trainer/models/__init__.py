"""Detection models: building them from MODEL.* keys (builders), their initial weights (weights)."""
from trainer.models.builders import (BACKBONES, MODEL_TYPES, build_model, describe_model, set_test_size,
                                     set_train_size, unread_keys, unwrap)
from trainer.models.weights import LoadReport, load_error, load_weights

__all__ = ["BACKBONES", "MODEL_TYPES", "LoadReport", "build_model", "describe_model", "load_error", "load_weights",
           "set_test_size", "set_train_size", "unread_keys", "unwrap"]
