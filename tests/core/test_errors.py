"""Errors: one base, builtin parents, picklable, messages that say what to do."""

import pickle

import pytest

import palaestra.errors as errors


@pytest.mark.parametrize("name", errors.__all__)
def test_errors_pickle_and_share_the_base(name):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.PalaestraError)
    exc = cls("how to fix it")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == "how to fix it"


def test_errors_inherit_the_builtin_they_replace():
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.EnvNotFoundError, KeyError)
    assert issubclass(errors.MissingExtraError, ImportError)
    with pytest.raises(ValueError):
        raise errors.ConfigError("x")


def test_missing_extra_names_the_install_command():
    assert "pip install 'palaestra[docker]'" in str(errors.MissingExtraError.for_module("docker", "docker"))
