"""vitscale: pre-train Vision Transformers at scale with DeepSpeed, stream WebDataset shards,
measure transfer on CIFAR-100 and VTAB-1k."""
import os

from setuptools import find_packages, setup

setup(
    name="vitscale",
    version="0.1.0",
    description="Pre-training Vision Transformers at scale: WebDataset shards, DeepSpeed ZeRO, transfer evaluation",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["pretrain", "pretrain.*", "data_pipeline", "data_pipeline.*",
                                    "launch", "launch.*"]),
    package_data={"pretrain.perf": ["published_runs.json"]},
    install_requires=[
        "torch>=2.4",
        "torchvision>=0.19",
        "deepspeed>=0.19.0,<0.20.0",  # pretrain/distributed/ds_compat.py: the tested range
        "webdataset>=0.2.86",
        "wandb>=0.17",
        "pyyaml>=6.0",
        "fvcore>=0.1.5.post20221221",
        "safetensors>=0.4",
        "tqdm>=4.66",
        "numpy>=1.24",
        "pillow>=10.0",
        "matplotlib>=3.7",
        "imagehash>=4.3",  # vit-audit's perceptual hash (pulls scipy, PyWavelets)
    ],
    extras_require={
        # s3:// shards (data_pipeline/storage/s3.py); 1.28.57: AWS_ENDPOINT_URL(_S3) honoured
        "s3": ["boto3>=1.28.57"],
        # data.worker_decoder: nvimgcodec, workers decode only each crop's window (CPU backend, no GPU needed)
        "decode": ["nvidia-nvimgcodec-cu13>=0.9"],
        # data.decode_device: dali (the DALI build for torch's CUDA 13; its CPU operators need no GPU).
        # ~230 MB to download, ~520 MB installed: in `test` so that CI runs its CPU tests.
        "dali": ["nvidia-dali-cuda130>=2.4"],
        "test": ["nvidia-nvimgcodec-cu13>=0.9", "nvidia-dali-cuda130>=2.4", "pytest>=8.0", "pytest-xdist>=3.6",
                 "ruff>=0.6", "timm>=1.0", "scikit-image>=0.22", "transformers>=4.40",
                 "boto3>=1.28.57", "moto[server]>=5.0",  # moto: the S3 API server of tests/s3_server.py
                 "scikit-learn>=1.3"],  # the linear probe's reference (LogisticRegression)
    },
    entry_points={
        "console_scripts": [
            "vit-shards=data_pipeline.shards.cli:main",
            "vit-train=pretrain.train:command",
            "vit-export=pretrain.weights.export:main",
            "vit-transfer=pretrain.transfer.cli:command",
            "vit-launch=launch.cli:main",
            "vit-flops=pretrain.observability.flops:main",
            "vit-config=pretrain.config.cli:main",
            "vit-analyze=pretrain.evaluation.analyze:main",
            "vit-audit=pretrain.evaluation.audit:main",
        ],
    },
)
