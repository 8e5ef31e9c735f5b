// luahealth evaluates an Argo CD resource health script on Kubernetes objects
// the way the Argo CD application controller does for scripts set in argocd-cm
// (resource.customizations.health.<group>_<Kind>): gopher-lua without its
// standard libraries except base, table and package, the object as the global
// `obj` (JSON objects as tables, arrays as 1-based tables, numbers as
// numbers), one second per evaluation, and the returned table read as
// {status, message}.
//
// Usage: luahealth SCRIPT < objects.json   (a JSON array of objects)
// Output: a JSON array of {"status": ..., "message": ...} in the same order,
// or {"error": ...} for an object the script failed on.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	lua "github.com/yuin/gopher-lua"
)

type result struct {
	Status  string `json:"status,omitempty"`
	Message string `json:"message,omitempty"`
	Error   string `json:"error,omitempty"`
}

// Argo CD accepts these and turns anything else into Unknown.
var valid = map[string]bool{
	"Healthy": true, "Progressing": true, "Degraded": true,
	"Suspended": true, "Missing": true, "Unknown": true,
}

func toLua(state *lua.LState, value any) lua.LValue {
	switch v := value.(type) {
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case []any:
		table := state.CreateTable(len(v), 0)
		for _, item := range v {
			table.Append(toLua(state, item))
		}
		return table
	case map[string]any:
		table := state.CreateTable(0, len(v))
		for key, item := range v {
			table.RawSetH(lua.LString(key), toLua(state, item))
		}
		return table
	}
	return lua.LNil
}

func field(table *lua.LTable, name string) (string, error) {
	value := table.RawGetString(name)
	switch value.Type() {
	case lua.LTNil:
		return "", nil
	case lua.LTString:
		return value.String(), nil
	}
	return "", fmt.Errorf("%s is a %s, not a string", name, value.Type())
}

func evaluate(script string, object map[string]any) result {
	state := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer state.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
	} {
		fn := state.NewFunction(lib.open)
		if err := state.CallByParam(lua.P{Fn: fn, Protect: true}, lua.LString(lib.name)); err != nil {
			return result{Error: err.Error()}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	state.SetContext(ctx)
	state.SetGlobal("obj", toLua(state, object))
	if err := state.DoString(script); err != nil {
		return result{Error: err.Error()}
	}
	returned, ok := state.Get(-1).(*lua.LTable)
	if !ok {
		return result{Error: fmt.Sprintf("the script returned a %s, not a table", state.Get(-1).Type())}
	}
	status, err := field(returned, "status")
	if err != nil {
		return result{Error: err.Error()}
	}
	message, err := field(returned, "message")
	if err != nil {
		return result{Error: err.Error()}
	}
	if !valid[status] {
		return result{Error: fmt.Sprintf("invalid health status %q", status)}
	}
	return result{Status: status, Message: message}
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: luahealth SCRIPT < objects.json")
		os.Exit(2)
	}
	script, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var objects []map[string]any
	if err := json.NewDecoder(os.Stdin).Decode(&objects); err != nil {
		fmt.Fprintln(os.Stderr, "objects:", err)
		os.Exit(2)
	}
	results := make([]result, 0, len(objects))
	for _, object := range objects {
		results = append(results, evaluate(string(script), object))
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
