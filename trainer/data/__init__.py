"""Training and test data: Detectron's dataset catalog and COCO-format datasets (coco.py), their
checks before anything trains (checks.py), their segmentations (masks.py), the synthetic dataset of
the demo and tests (synth.py), the resumable batch sampler (sampler.py), the loader workers' set-up
(workers.py) and the batch prefetcher (prefetch.py)."""
from trainer.data.coco import (CocoDetection, build_test_loader, build_train_dataset, build_train_loader,
                               check_test_datasets, image_list_of, model_needs, resolve_dataset)

__all__ = ["CocoDetection", "build_test_loader", "build_train_dataset", "build_train_loader", "check_test_datasets",
           "image_list_of", "model_needs", "resolve_dataset"]
