from setuptools import find_packages, setup


def requirements():
    with open("requirements.txt") as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


setup(
    name="flexfloor",
    version="0.1.0",
    description="Synchronous RL post-training of MoE LLMs on Megatron-Core with elastic expert "
    "parallelism: ranks whose responses are done leave the rollout early",
    packages=find_packages(include=["flexfloor", "flexfloor.*", "megatron_ext", "megatron_ext.*"]),
    package_data={"flexfloor": ["data/assets/*"], "megatron_ext": ["csrc/*.c"]},
    python_requires=">=3.11",
    install_requires=requirements(),
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "test": ["pytest"],
    },
)
