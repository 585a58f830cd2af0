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
    install_requires=[
        "torch>=2.4",
        "torchvision>=0.19",
        "deepspeed>=0.16",
        "webdataset>=0.2.86",
        "wandb>=0.17",
        "pyyaml>=6.0",
        "fvcore>=0.1.5.post20221221",
        "safetensors>=0.4",
        "tqdm>=4.66",
        "numpy>=1.24",
        "pillow>=10.0",
        "matplotlib>=3.7",
    ],
    extras_require={"test": ["pytest>=8.0", "timm>=1.0"]},
    entry_points={
        "console_scripts": [
            "vit-shards=data_pipeline.write_shards:main",
            "vit-train=pretrain.train:main",
            "vit-export=pretrain.export:main",
            "vit-transfer=pretrain.transfer.cli:main",
            "vit-launch=launch.cli:main",
            "vit-flops=pretrain.flops:main",
            "vit-config=pretrain.config:main",
        ]
    },
)
