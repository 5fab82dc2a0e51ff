"""The core imports no application-only package; a missing one is named with the extra to install."""

import re
import subprocess
import sys

import pytest

from transformers_ccm.extras import APPS_EXTRA, require


def test_the_core_imports_no_application_package():
    code = (
        "import sys, transformers_ccm, transformers_ccm.modeling, transformers_ccm.cache, transformers_ccm.cli;"
        "print(sorted(m for m in ('faker', 'matplotlib', 'gguf') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_a_missing_package_names_the_extra():
    message = re.escape(f"Plotting needs the package 'ccm_absent': {APPS_EXTRA}")
    with pytest.raises(ImportError, match=message):
        require("ccm_absent.pyplot", "Plotting")
