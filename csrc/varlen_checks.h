// The host-side check of varlen offsets (flash_api.cpp) costs a device sync. The autograd backward
// (flash_autograd.cpp) holds this guard while it calls the backward op: its forward already checked
// the same offsets, which autograd saved and keeps from being modified in place.
#pragma once

namespace flash {

class VarlenOffsetsChecked {
 public:
  VarlenOffsetsChecked();
  ~VarlenOffsetsChecked();
  VarlenOffsetsChecked(const VarlenOffsetsChecked&) = delete;
  VarlenOffsetsChecked& operator=(const VarlenOffsetsChecked&) = delete;
  static bool active();  // on this thread

 private:
  bool previous_;
};

}  // namespace flash
