"""Package layout: kernels/, tracking/ and configs/ sit at the top of the repository but install as
visionssm.kernels, visionssm.tracking and visionssm.configs, so nothing generic lands at the top of site-packages.
Everything else about the package is in pyproject.toml."""

from setuptools import find_packages, setup

SUBPACKAGE_DIRS = {"visionssm.kernels": "kernels", "visionssm.tracking": "tracking", "visionssm.configs": "configs"}

packages = find_packages(include=["visionssm", "visionssm.*"])
package_dir = {"visionssm": "visionssm"}
for name, directory in SUBPACKAGE_DIRS.items():
    package_dir[name] = directory
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(directory)]

# The YAML recipes are data, not modules: they travel with the package so that a wheel finds them anywhere.
setup(packages=packages, package_dir=package_dir, package_data={"visionssm.configs": ["*/*.yaml"]})
