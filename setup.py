"""Package layout: kernels/ and tracking/ sit at the top of the repository but install as
visionssm.kernels and visionssm.tracking, so nothing generic lands at the top of site-packages.
Everything else about the package is in pyproject.toml."""

from setuptools import find_packages, setup

SUBPACKAGE_DIRS = {"visionssm.kernels": "kernels", "visionssm.tracking": "tracking"}

packages = find_packages(include=["visionssm", "visionssm.*"])
package_dir = {"visionssm": "visionssm"}
for name, directory in SUBPACKAGE_DIRS.items():
    package_dir[name] = directory
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(directory)]

setup(packages=packages, package_dir=package_dir)
