"""Package layout: kernels/, tracking/ and configs/ sit at the top of the repository but install as
visionssm.kernels, visionssm.tracking and visionssm.configs, so nothing generic lands at the top of site-packages.
Everything else about the package is in pyproject.toml."""

from setuptools import find_namespace_packages, find_packages, setup

SUBPACKAGE_DIRS = {"visionssm.kernels": "kernels", "visionssm.tracking": "tracking", "visionssm.configs": "configs"}

packages = find_packages(include=["visionssm", "visionssm.*"])
package_dir = {"visionssm": "visionssm"}
for name, directory in SUBPACKAGE_DIRS.items():
    package_dir[name] = directory
    # configs/ holds folders of YAML recipes without __init__.py: listed as (namespace) packages so that setuptools
    # ships them as the package's data instead of warning that an importable folder is left out
    find = find_namespace_packages if name == "visionssm.configs" else find_packages
    packages += [name] + [f"{name}.{sub}" for sub in find(directory, exclude=["__pycache__*", "*.__pycache__"])]

# The YAML recipes are data, not modules: they travel with the package so that a wheel finds them anywhere.
package_data = {name: ["*.yaml"] for name in packages if name.startswith("visionssm.configs.")}
setup(packages=packages, package_dir=package_dir, package_data=package_data)
