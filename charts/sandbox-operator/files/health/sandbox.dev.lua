-- Argo CD health of the sandbox.dev kinds Sandbox, Execution and Snapshot
-- (argocd-cm: resource.customizations.health.sandbox.dev_<Kind>, see docs/operations.md).
-- Reads what the operator writes for every kind: status.observedGeneration,
-- the Ready condition, and the kstatus conditions Stalled and Reconciling.
-- Argo CD runs it without Lua's string library: base and table functions only.
local hs = {status = "Progressing", message = "Waiting for the operator"}

local function condition(status, kind)
  if type(status.conditions) ~= "table" then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(c)
  local reason = c.reason or ""
  if c.message ~= nil and c.message ~= "" then
    if reason == "" then
      return c.message
    end
    return reason .. ": " .. c.message
  end
  return reason
end

-- As Argo CD shows any object being deleted (its finalizers still at work).
if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  hs.message = "Pending deletion"
  return hs
end
local status = obj.status
if type(status) ~= "table" then
  return hs
end
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end
local ready = condition(status, "Ready")
if ready == nil then
  return hs
end
if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

-- Final failures: a bad spec, an image without python3, a failed or timed out
-- command, a snapshot the CSI driver failed or lost. The phase is the fallback
-- for statuses written before the operator set Stalled.
local stalled = condition(status, "Stalled")
local final = {Failed = true, TimedOut = true, Cancelled = true}
if (stalled ~= nil and stalled.status == "True") or final[status.phase] then
  hs.status = "Degraded"
  hs.message = describe(stalled or ready)
  return hs
end
-- A paused Sandbox rests where its spec asked it to be: its pod is deleted,
-- its workspace kept, until spec.paused is false again.
if obj.kind == "Sandbox" and ready.reason == "Paused" then
  hs.status = "Suspended"
  hs.message = describe(ready)
  return hs
end
hs.message = describe(condition(status, "Reconciling") or ready)
return hs
