import pluggy
hookspec = pluggy.HookspecMarker("layerzoo")
hookimpl = pluggy.HookimplMarker("layerzoo")
