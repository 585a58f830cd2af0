"""vitscale: pre-train Vision Transformers at scale with DeepSpeed, stream WebDataset shards,
measure transfer on CIFAR-100 and VTAB-1k."""
from setuptools import setup

setup(
    name="vitscale",
    version="0.1.0",
    description="Pre-training Vision Transformers at scale: WebDataset shards, DeepSpeed ZeRO, transfer evaluation",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["pretrain", "pretrain.transfer", "data_pipeline", "launch"],
    package_data={"launch": ["published_runs.json"]},
    install_requires=[
        "torch>=2.4",
        "torchvision>=0.19",
        "deepspeed>=0.19.0,<0.20.0",  # pretrain/ds_compat.py: the tested range
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
    extras_require={"test": ["pytest>=8.0", "pytest-xdist>=3.5", "timm>=1.0", "scikit-image>=0.22", "transformers>=4.40"]},
    entry_points={
        "console_scripts": [
            "vit-shards=data_pipeline.write_shards:main",
            "vit-train=pretrain.train:main",
            "vit-export=pretrain.export:main",
            "vit-transfer=pretrain.transfer.cli:main",
            "vit-launch=launch.cli:main",
            "vit-flops=pretrain.flops:main",
            "vit-config=pretrain.config:main",
            "vit-analyze=pretrain.analyze:main",
            "vit-audit=data_pipeline.audit:main",
        ],
        # evaluation-set readers of vit-audit that live above the data floor (data_pipeline/audit.py)
        "vitscale.audit_readers": [
            "cifar100=pretrain.audit_readers:cifar100",
            "vtab1k=pretrain.audit_readers:vtab1k",
            "imagefolder=pretrain.audit_readers:imagefolder",
        ],
    },
)
