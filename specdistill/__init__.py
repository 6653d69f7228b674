__version__ = "0.1.0"

# Config resolvers the Hydra configs use (conf/task/arith.yaml, conf/models/tiny.yaml, conf/models/smollm2_135m.yaml):
# registered on import, so that every composed config resolves in train.py, in tests and in user code alike.
from specdistill.utils.package_files import register_resolvers as _register_package_resolvers
from specdistill.utils.seeds import register_resolvers as _register_resolvers

_register_resolvers()
_register_package_resolvers()
