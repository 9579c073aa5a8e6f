"""The registry's credentials go only to a token realm on the registry's own host, or one the user allowed."""

from __future__ import annotations

import pytest

from bundler.cli import main
from manifests.errors import RegistryAuthError
from runtime.store.registry_ping import check_realms, parse_challenges
from tests.runtime.store.registry.server import PASSWORD, USER, start_registry
from tests.runtime.store.registry.token_server import TokenServer


def test_challenges_are_parsed_and_only_foreign_bearer_realms_refused():
    (basic,) = parse_challenges(['Basic realm="bundle-test"'])
    assert (basic.scheme, basic.params) == ("basic", {"realm": "bundle-test"})
    two = parse_challenges(['Bearer realm="https://reg.lan:5001/token",service="reg, \\"x\\"",scope=a:b:pull',
                            'Basic realm=x'])
    assert [c.scheme for c in two] == ["bearer", "basic"]
    assert two[0].params == {"realm": "https://reg.lan:5001/token", "service": 'reg, "x"', "scope": "a:b:pull"}

    def check(header: str, host: str = "reg.lan:5000", allowed: tuple[str, ...] = ()) -> None:
        check_realms(host, parse_challenges([header]), allowed)
    check('Bearer realm="https://reg.lan:5001/token"')  # the registry's host, another port
    check('Bearer realm="https://REG.lan/service/token"')
    check('Basic realm="anything at all"')  # basic credentials go to the registry itself
    check('Bearer realm="http://[::1]:9/token"', host="[::1]:5000")
    check('Bearer realm="https://auth.lan/token"', allowed=("auth.lan",))
    check('Bearer realm="https://auth.lan:8443/token"', allowed=("auth.lan:8443",))
    for header, allowed in [('Bearer realm="https://auth.lan/token"', ()),
                            ('Bearer realm="https://auth.lan:8443/token"', ("auth.lan:9443",)),
                            ('Bearer realm="https://reg.lan.evil.example/token"', ()),
                            ('Bearer realm="file:///etc/passwd"', ()),
                            ('Bearer realm="/token"', ())]:
        with pytest.raises(RegistryAuthError, match="reg.lan:5000") as e:
            check(header, allowed=allowed)
        assert "refusing to send it the credentials" in str(e.value)


@pytest.mark.slow
def test_a_token_realm_on_another_host_gets_no_credentials_unless_allowed(bundles, tmp_path, capsys):
    tokens = TokenServer(tmp_path / "token", USER, PASSWORD, host="127.0.0.2")  # another host than 127.0.0.1
    registry = start_registry(tmp_path / "registry", token_server=tokens)
    try:
        ref = f"{registry.host}/fleet/demo:1"
        args = ["--ca-file", str(registry.ca), "--authfile", str(registry.authfile), "--no-progress"]
        for argv in (["push", str(bundles["v1"]), ref, *args], ["pull", ref, str(tmp_path / "a"), *args]):
            capsys.readouterr()
            assert main(argv) == RegistryAuthError.exit_code
            err = capsys.readouterr().err
            assert tokens.realm in err and registry.host in err and "--allow-token-realm 127.0.0.2" in err, err
            assert len(err.strip().splitlines()) == 1, err
        assert tokens.requests == []  # the realm never saw the password, nor any request
        allow = ["--allow-token-realm", "127.0.0.2"]
        assert main(["push", str(bundles["v1"]), ref, *args, *allow]) == 0
        assert main(["pull", ref, str(tmp_path / "b"), *args, *allow]) == 0
        assert [s for s, _ in tokens.requests] and all(s == 200 for s, _ in tokens.requests)
    finally:
        registry.stop()
        tokens.stop()
